"""kvfence: shared core (config, model, page pool, manifest, transfer, events, auth, errors,
client)."""

__version__ = "0.1.0"

# The contract between a control plane and its nodes: registration and heartbeats, the node RPCs
# and what their fields mean, the node token, the transfer manifest. Raised by a release whose
# control plane and nodes would misread each other (a field's meaning changed, a check one side
# now requires): a control plane refuses to register a node that speaks another one, with both
# versions in the reason, instead of failing its requests once they reach it. Releases before
# this number existed send none (0). Within one protocol version, releases may differ.
PROTOCOL_VERSION = 1
