"""What a site's messages reveal: secure aggregation (:mod:`fedseg.privacy.secagg`,
:mod:`fedseg.privacy.protocol`).  Imports only :mod:`fedseg.foundation`; the cryptography
libraries (``cryptography``, ``pycryptodome``: the ``privacy`` extra) are imported when used."""
