"""The chaos suite: hostile requests, faults and shutdowns against a live server (the
session's, tests/helpers/live_server.py) while innocent streams run."""
