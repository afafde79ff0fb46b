"""The read path of the store: a read's rows (rows.py), chunk headers
(headers.py), the per-chunk plan (plan.py), its routes (routes.py) and the
reader that runs them (reader.py). Never imports store.write."""
