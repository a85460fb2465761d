"""The commands: ``python -m p2ptrain join | peers | doctor`` (``cli`` parses, one module each;
``join_output`` is what ``join`` shows).

May import every other part of the package; nothing imports it but ``p2ptrain.__main__``.
"""
