"""The silo agent: a long-running process next to a silo's data that takes part in consortium rounds."""
