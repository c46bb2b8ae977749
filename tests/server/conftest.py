"""The live server's fixtures come from tests/helpers/live_server.py (a plugin of the root
conftest, shared with tests/reliability)."""
