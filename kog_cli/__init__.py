"""The commands (top floor): `kog` and its subcommands, `kog bench`, the HTTP gateway of `kog serve`.
They drive the rank program (workers/) and the core (kog_dist/); nothing below imports them."""
