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

import importlib  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

DEFERRED = ("scipy.optimize",)  # modules hivemind imports at its own import and this runtime never uses


class _Deferred(types.ModuleType):
    """A module registered under its name but not run yet: the first attribute it lacks (any of the real module's)
    imports the real one in its place. Not importlib.util.LazyLoader's lazy module: the import statement itself
    reads a module's `__spec__`, which runs that one at once. Its `__path__` is the real module's only: a submodule's
import runs the real package first."""

    def __getattr__(self, attr: str):
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


def _defer(name: str) -> None:
    """`name` (a submodule) is imported at its first use, not by an `import` statement (hivemind's
    `hivemind.averaging.load_balancing` imports scipy.optimize for a linprog that peers and coordinators never call:
    ~0.35 s of every process's start on an idle core, half of hivemind's own import after torch's)."""
    parent, _, child = name.rpartition(".")
    if name in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(name)  # (imports the parent package: scipy's alone is ~20 ms)
    except ImportError:
        return
    if spec is None:
        return
    module = _Deferred(name)
    # what a scan of sys.modules reads of every module (inspect.getmodule's, which torch's import runs) is there
    module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
    module.__package__ = name if spec.submodule_search_locations is not None else parent
    sys.modules[name] = module
    setattr(sys.modules[parent], child, module)


for _name in DEFERRED:  # before any module of this package imports hivemind
    _defer(_name)
