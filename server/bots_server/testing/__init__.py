"""What tests and benchmarks share, shipped with the server so both can use it
(benchmarks do not import the test suite):

    inprocess.py   the service in this process, reached through a channel
                   object instead of a socket (no network, real messages)
    processes.py   `bots-server serve` as a child process on a real port
    tenants.py     principals of several tenants: tokens, credentials, uploads
    postgres.py    throwaway PostgreSQL databases on a running server
"""
