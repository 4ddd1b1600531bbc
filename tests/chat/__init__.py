"""Tests of the chat app."""
