"""Faults from outside: the injector that acts out a fault schedule at the coordinator's one hook and around its
transport (injector.py), and `checkfree chaos`, a long local run under churn (chaos.py). Tests and chaos
runs only: the commands that build it from their testing flags are the only other importers
(tests/test_faults_from_outside.py lists them)."""
