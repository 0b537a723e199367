"""The operator's tools: the live dashboard (dashboard.py, dashboard.html), a swarm's state as one value
(status.py) and `checkfree status` (status_cli.py), a run's history from its run directory (history.py), and
`checkfree export` (export_cli.py)."""
