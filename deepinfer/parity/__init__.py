"""`deepinfer parity`: the seed's numerical-debugging workflow as tested tools (engine vs reference).

Each command returns a `Report` (a table + machine-readable rows + a verdict); the CLI prints it, writes
`--json`, and exits 0 whenever it ran, whatever it found.
"""
