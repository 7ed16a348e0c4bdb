"""Loop control: until, early_stop, cadence, evaluate."""
