"""step, steps, accumulate and the parts of a window: one update out of micro-steps."""
