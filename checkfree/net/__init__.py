"""Networking shared by peers and coordinator: the wire format and the P2P RPC transport.

Lives in the library so that `peers/` and the coordinator's packages (`coordinator/`, `swarm/`, `faults/`, `ops/`) both
use it without importing each
other; nothing else in `checkfree` imports its modules (hivemind is loaded only there; the CLI
reads `TRANSPORTS` from this package alone).

Three RPC transports implement one protocol (`base.Transport`: `register`, `call`, `peer_id`,
`extra_header`, `kind`, `shutdown`; type-checked in the tests): `hivemind_transport.HivemindTransport` on
hivemind's go-libp2p daemon, `libp2p_transport.Libp2pTransport` on py-libp2p and
`tcp_transport.TcpTransport` on direct, unencrypted TCP connections (trusted networks);
`factory.start_transport(..., transport=...)` starts any of them beside the hivemind DHT, which keeps
membership (heartbeats, the coordinator's record, RPC addresses) in every case. `transport` is the
one-import API over these modules.
"""

TRANSPORTS = ("hivemind", "libp2p", "tcp")  # --transport: RPC over hivemind's p2pd (default), py-libp2p or plain TCP
