"""KV events, block keys and the prefix index (memory and Redis backends).

Nothing here knows about HTTP: the router and the standalone indexer process drive it.
"""
