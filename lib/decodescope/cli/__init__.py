"""Layer 10, cli: the `decodescope` command and its subcommands."""
