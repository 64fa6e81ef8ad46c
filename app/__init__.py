"""npuchat application: command line, Textual UI, settings and conversation store."""
