"""`python -m services.synthetic`: one synthetic replica on a port, for tests and benches."""

from services.synthetic.replica import main

main()
