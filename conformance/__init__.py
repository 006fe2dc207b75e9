"""The statecache conformance suite: the cases every backend and device must
pass, shipped as a pytest plugin (``pytest --pyargs statecache.conformance
--backend NAME``) and run by ``statecache conformance``.

Layout: ``cases.py`` (case record, guard bands, comparisons),
``*_cases.py`` (the cases as data, by family), ``oracle.py`` (float64 loops
independent of the reference, which the ``oracle`` family compares every
device with), ``catalog.py`` (all of them),
``selection.py`` (devices and expected failures), ``plugin.py`` (pytest),
``cli.py`` (the command), ``perf.py`` (``--perf``), ``model.py`` (the tiny
hybrid model the memory cases run), ``test_*.py`` (the thin test functions).
"""

#: Bumped whenever a case is added, removed or made stricter, so reports from
#: different suite versions are never compared as equals.
#: 2.0: backend protocol 2 (packed tokens, snapshot tables, epilogues, activations); 2.1: prefix family;
#: 2.2: oracle family, branch-reaching primitive inputs; 2.3: the linear-attention primitives (rwkv_wkv6,
#: rwkv_wkv7, gated_linear_attn) and a recurrent model of every state family in the memory cases;
#: 2.4: DLPack tensors as arguments (device.tensors.*); 2.5: a whole mixed batch in one packed ubatch
#: (memory.*[varlen_batch-*]) and non-finite log decays placed as exp places them (*.nonfinite_decay).
SUITE_VERSION = "2.5"
