"""Networking shared by peers and coordinator: the wire format and the P2P RPC transport.

Lives in the library so that `peers/` and `scheduler/` both use it without importing each
other; nothing else in `checkfree` imports its modules (hivemind is loaded only there; the CLI
reads `TRANSPORTS` from this package alone).

Two RPC transports share one interface (`register`, `call`, `peer_id`, `extra_header`, `kind`):
`transport.Transport` on hivemind's go-libp2p daemon and `libp2p_transport.Libp2pTransport` on
py-libp2p; `transport.start_transport(..., transport=...)` starts either beside the hivemind DHT,
which keeps membership (heartbeats, the coordinator's record) in both cases.
"""

TRANSPORTS = ("hivemind", "libp2p")  # --transport: RPC over hivemind's p2pd (default), or over py-libp2p
