"""The lowest layer: records, block hashes, errors, salts, tasks; it imports nothing above it."""
