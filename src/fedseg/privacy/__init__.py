"""What a site's messages reveal, and how fedseg limits it: secure aggregation (:mod:`fedseg.privacy.secagg`,
:mod:`fedseg.privacy.protocol`; its keys signed with a site's certificate, :mod:`fedseg.privacy.identity`) and differential privacy (``dp``: DP-SGD's privatized gradients and clipped,
noised updates; ``accountant``: ε per site).  Imports only :mod:`fedseg.foundation`; the cryptography and
privacy libraries (``cryptography``, ``pycryptodome``, ``opacus``: the ``privacy`` extra) are imported when used."""
