"""detach_logging: metrics kept on the device, reduced, read once per interval, sunk."""
