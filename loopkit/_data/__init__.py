"""Getting batches to the model: to_device, the seeded resumable loader, preload."""
