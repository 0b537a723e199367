"""The coordinator: `Coordinator` (coordinator.py) wires its parts, each in a module of its own and the only
writer of its state; `checkfree scheduler` (scheduler_cli.py) is its command."""
