"""Textual user interface: App, screens and widgets."""
