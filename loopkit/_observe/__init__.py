"""Seeing what a loop does: the doctor, host-sync counting, memory tracking."""
