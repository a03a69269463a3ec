"""Adapters at the RL frameworks' own extension points, one module per framework; each imports
its framework only when used.  docs/integrations/<framework>.md has the lines a user changes."""
