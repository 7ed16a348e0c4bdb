"""The Checkpointer: files on disk, the state-piece contract, the built-in pieces, resume."""
