"""The request path's phases, in order: authenticate → limit → pick → attempt → relay → finish.

Each is a small module with one job and its own failure answer; ``gateway/relay.py`` runs them in
that order for every inference request, with one ``Exchange`` (``gateway/exchange.py``) carrying
what each learned. The relay phase itself lives in ``gateway/stream_relay.py`` (streams) and
``gateway/whole_answer.py`` (whole answers).
"""
