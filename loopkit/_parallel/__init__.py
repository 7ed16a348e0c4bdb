"""What synchronizes a model's gradients across ranks: no_sync, the by-hand all-reduce, wrap."""
