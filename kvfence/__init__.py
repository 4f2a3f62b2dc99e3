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

# The longest per-call deadline a client sets, in seconds (about 11.6 days, past any call): gRPC's
# deadline overflows above about 1e9 s, and a timeout of inf or 1e10 failed the call at once with
# DEADLINE_EXCEEDED, though nothing was sent. kvfence.client refuses a longer one
# (InvalidArgument), and the CLI's --timeout options take it as their maximum (a usage error).
MAX_TIMEOUT_S = 1_000_000
