"""checkpointed: activation checkpointing as a decorator or applied to modules."""
