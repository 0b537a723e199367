"""Networking shared by peers and coordinator: the wire format and the P2P RPC transport.

Lives in the library so that `peers/` and `scheduler/` both use it without importing each
other; nothing else in `checkfree` imports it (hivemind is loaded only here).
"""
