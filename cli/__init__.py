"""The `checkfree` command: one parser over the library's, the peer's and the scheduler's subcommands."""
