"""Helpers that tests share: import them from here, never from another test."""
