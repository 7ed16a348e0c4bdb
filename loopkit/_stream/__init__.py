"""Streamed data resumed exactly: shuffle_buffer, stream_shards, replayed."""
