"""The local swarm: `checkfree local` (local_cli.py) starts a coordinator and its peers as OS processes on this
machine (launcher.py, processes.py), in network namespaces of their own with --netns (netlab.py)."""
