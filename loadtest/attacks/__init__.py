"""Attack clients against the gateway's listeners: slow, abusive and malformed clients over HTTP/1.1
(``h1``), HTTP/2 (``h2``) and HTTP/3 (``h3``). Each attack is a function taking a host, a port and a
few sizes, and returning what it observed (how the server answered, how much it sent before being cut
off), for the system tests (tests/test_h1_limits.py, tests/test_h2_limits.py) and the benchmark's attack
table. Meant for 127.0.0.1 and a gateway you run yourself.
"""
