"""Privacy on the coordinator: client-level differential privacy (dp.py: the noised sum, Poisson
sampling, the accountant) and secure sums (secure_sum.py: the aggregate the coordinator can
unmask only as a sum, over fedseq.common.secagg).

Imports fedseq.common only: the round calls these as named steps; they call nothing back.
"""
