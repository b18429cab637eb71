"""The processes: composition roots that build kvroute's parts from the config and run them.

``cli`` dispatches ``kvroute COMMAND`` (importing only the command's module); ``build`` is the one place
the router's parts are wired (used by ``serve``, ``epp`` and ``indexer``); ``sim`` and ``demo`` run the
simulated fleet and the comparison. Libraries never import from here.
"""
