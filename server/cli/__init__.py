"""The commands: fedseq-sim and fedseq-server (commands.py), fedseq (tools.py), fedseq new
(new_package.py), and their entry points (launch.py, which a device may run to be told no: it and
this file stay importable by Python 3.6). A command parses its options and calls a room below.
"""
