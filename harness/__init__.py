"""The in-process tier's harness (inprocess.py): the real coordinator and peer daemons in one event loop over the
memory network. The tests, dst and the benchmarks import it from here."""
