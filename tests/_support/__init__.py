"""Helpers shared by the tests of several folders (imported as ``tests._support.<name>``)."""
