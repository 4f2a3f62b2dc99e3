"""``python -m kvfence`` runs the CLI (what `kvfence up` uses to start its children)."""

from kvfence.entry import main

main()
