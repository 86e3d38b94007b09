"""``branchbox gateway``: one front door for many daemons, each on its own node.

A family's sandboxes share memory pages, so a family lives on one node; what scales out
is the number of families. The gateway keeps no state that matters: every sandbox id
names its node (``engine.node``), the nodes come from a static list or the Kubernetes
API (``discovery``), and their tags and load from each node's ``GET /v1/node``
(``nodes``). So any number of replicas route any request alike (``app``).
"""
