"""Secure aggregation as messages: what a site and the server each do at each step of one exchange.

One exchange sums one array dictionary over the sites (Bonawitz et al. 2017, Fig. 4, the consistency
check included; the arithmetic and its guarantees are :mod:`fedseg.privacy.secagg`'s, the signatures
:mod:`fedseg.privacy.identity`'s).  Every message is JSON (keys and shares as hex strings) or the masked
arrays, so any transport carries it:

====  =======================================  =============================================
step  server → site                             site → server
====  =======================================  =============================================
1     ``keys``: the exchange id                 its public keys C_u, S_u and the hash of b_u (signed)
2     ``shares``: everyone's public keys (U1)  its shares of s_u and b_u, sealed per peer; the peers
                                               whose keys it refused; the hash of every share
3     the task + the shares sealed for it (U2) the task's arrays, encoded and masked
4a    ``consistency``: who dropped, who        its attestation of U3
      survived (U3)
4b    ``reveal``: the same lists and the       shares of s_d (dropped) and of b_u (survived)
      survivors' attestations
====  =======================================  =============================================

**What a site checks** (against an active server, Bonawitz et al. Section 6 and Flower's SecAgg+ client):
U1 and U2 hold at least ``min_sites`` sites (``privacy.secagg_min_sites``) and U2 at least t = ⌊|U1|/2⌋ + 1;
it masks once per exchange and remembers U2; the lists of 4a and 4b must split U2 exactly with itself and at
least t sites among the survivors; it attests one U3 per exchange, and reveals only for the U3 it attested
and only after every survivor attested that same U3 (t of them at least).  Two different survivor sets
would each need t > |U1|/2 attestations, so some honest site would have attested both: at most one survivor
set per exchange gets any shares, and the server never gets both secrets of one site.

**One task per exchange.**  What a site attests binds the task it masked its reply to as well
(:func:`task_digest`: SHA-256 of the task's arrays — names, dtypes, shapes, bytes — and its config less the
``secagg`` fields), and a site reveals only when every survivor's attestation names the same digest as its
own.  A server that sends the target real weights and the others all-zero weights (their updates are then
known, and the sum minus them is the target's update) gets no share: the target's digest differs from the
others', so no site sees every survivor attest its own task.  What remains: a server that sends ONE crafted
model to every site learns only the sum of the replies to it, as for an honest model — bounded by DP
(``privacy.dp``), not by secure aggregation.

The attestation is the site's certificate's signature of :func:`survivors_statement` when it has an
identity; without one, an
HMAC-SHA256 of it for each other survivor under the key the pair derives from its ``c`` keys (X25519 + HKDF,
purpose "consistency"), which a server that relayed the ``c`` keys unchanged cannot compute (one that replaced
them holds every pair's key: only signed keys stop it).

**Share commitments.**  In step 2 each site sends the hash of every share it dealt
(:func:`fedseg.privacy.secagg.share_commitment`); the server checks each revealed share against its
owner's commitment and rebuilds each secret from the shares that match: a bad share costs one hash, not a
search over subsets of t shares.

:class:`SiteParty` is a site's side (kept between the steps of one exchange), :class:`ServerParty`
the server's: it routes the sealed shares, checks every reply (a malformed one raises
:class:`~fedseg.foundation.errors.PayloadError`, which the caller logs, leaving that site out) and
returns the unmasked sum of the sites whose masked input arrived, after checking its check word
(:func:`fedseg.privacy.secagg.canary`): a sum that holds an input masked for another exchange (replayed)
or another list of sites raises :class:`SumRejected`.

**Signed keys.**  A site with an :class:`~fedseg.privacy.identity.Identity` (its certificate and private key)
signs its step-1 keys and checks every peer's in step 2 (:meth:`~fedseg.privacy.identity.Identity.check_peer`).
It makes no share for a peer whose check fails and reports it with the reason; the server leaves that peer out
of the masking (:attr:`ServerParty.left_out`), so the others' sum comes out without it, and a site refuses to
mask with a peer it refused.  A site without an identity signs nothing and checks nothing.

**The roster.**  A deployed site's identity carries the federation's roster
(:class:`~fedseg.privacy.identity.Roster`): an exchange whose key list (U1), masking list (U2) or survivor
lists (U3) name a party that is not one of its sites is refused whole (no share dealt, nothing masked or
revealed), and a peer's certificate must be the one the roster pins for its name.
"""

from fedseg.privacy.protocol.messages import CANARY, MASKED, SumRejected, model_digest, survivors_statement, task_digest
from fedseg.privacy.protocol.server_party import ServerParty
from fedseg.privacy.protocol.site_party import SiteParty

__all__ = [
    "CANARY",
    "MASKED",
    "ServerParty",
    "SiteParty",
    "SumRejected",
    "model_digest",
    "survivors_statement",
    "task_digest",
]
