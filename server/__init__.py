"""fedseq package."""
