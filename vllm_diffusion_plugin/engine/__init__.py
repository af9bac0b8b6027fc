"""The engine: everything that turns a diffusers checkpoint into loaded (fused, sharded) modules."""
