"""Usage that lasts (SPEC O7): the records' tokens, requests and cost, rolled up in an
embedded SQLite database beside the records file, and read back by `relay usage`, the
status page and ``GET /relay/v1/usage``.

- `rollup`: a record (a JSON line) → its rollup key and counts; pure.
- `db`: the database — its tables, one transaction per batch, the queries.
- `tail`: reading a records file and its rotated ones from where the database stopped.
- `store`: `UsageStore`, the relay's own task that keeps the database up to date.
"""
