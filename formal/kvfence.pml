/*
 * kvfence: reserve / transfer / verify / decode / abort / release (DESIGN.md), in Promela.
 *
 * Processes
 *   ControlPlane(r)  one per request (request r belongs to tenant r): admission, Reserve RPC
 *                    to decode, hand-off to prefill, client cancel / operator abort (a Release
 *                    RPC to decode, or the Decode stream cancelled: both end in _release), or
 *                    the request ending while its Release is lost (the control plane logs and
 *                    forgets a failed Release): decode hears nothing, and only its own timeout
 *                    (the reaper) or the stream's end gives the pages back
 *   Prefill          runs a handed-off request: its hello (which decode verifies: the transfer
 *                    is RECEIVING), the batch header, one message per page, then a manifest
 *   Network          the data path: delivers any in-flight message (reordering), drops any
 *                    (loss); also UCX finishing a requested cancel of a posted receive. It also
 *                    carries the Decode call (which holds the manifest): delivered, lost, or
 *                    delivered with a duplicate left in flight that may arrive at any later time
 *   Decode           the event loop: the page pool, the reservations, the posted receives and
 *                    the Decode streams: posts a batch's receives (a step of its own after the
 *                    hello, which a Release and a new Reserve can come before; it checks that
 *                    the transfer still receives and owns its pages), verifies, times out,
 *                    quarantines and releases; a verified stream re-checks its reservation
 *                    after the `verified` message and only then adds its sequence to the batch;
 *                    a stream that reads finish or an error ends, and its `finally` releases
 *                    the reservation
 *   Batcher          the decode engine thread: per step and sequence, claims the page the step
 *                    writes into (ownership check + begin_ops under the batcher lock), writes it
 *                    and attends over the sequence's pages, then end_ops, then finishes or goes on
 *
 * Compile-time switches (spin -DNAME -a kvfence.pml)
 *   MUTANT_PLACEHOLDER         a rejected request still reserves and goes to prefill with a
 *                              1-token placeholder; decode accepts "transfer complete" without
 *                              the token-count / page-coverage check (the GLM-5.3 incident)
 *   MUTANT_RELEASE_ON_TIMEOUT  on a transfer timeout decode frees the reservation's pages at
 *                              once, while a cancelled receive may still land (SGLang #38961)
 *   MUTANT_PLACEHOLDER_CP_ONLY only the control-plane half of the above: decode still checks
 *                              count and coverage (expected to hold: defence in depth)
 *   MUTANT_NO_COUNT_CHECK      only the decode half: no count / coverage check; a prefill that
 *                              truncates its page list is then enough to break P1
 *   MUTANT_LEAK_QUARANTINE     quarantined pages are never released once their receives are
 *                              done (the page leak SGLang #27666 users report)
 *   MUTANT_RELEASE_IGNORES_OPS release (Release RPC, abort, duplicate Decode, stream end) frees
 *                              every page at once, ignoring begin_ops/end_ops: a decode step's
 *                              write may still land in the freed page
 *   MUTANT_ADD_AFTER_RELEASE   the Decode stream adds its sequence to the batch without
 *                              re-checking, after the `verified` yield, that its reservation is
 *                              still held
 *   MUTANT_POST_AFTER_RELEASE  the transfer handler posts a batch's receives without checking
 *                              that the transfer is still RECEIVING and the pool still gives its
 *                              pages to the reservation (kvfence before 4da9b7c), and the
 *                              endpoint abort of the Release did not take effect: receives
 *                              posted after a Release are live, and land in the pages of the
 *                              request that reserved them next (pool.begin_ops still refuses a
 *                              page that is free)
 *   MUTANT_NO_DECODE_TIMEOUT   decode never times out a transfer or reaps a reservation on its
 *                              own (no per-batch timeout, no reaper): it relies on the control
 *                              plane's Release, which may be lost
 *   MUTANT_CP_RESUMES_TERMINAL cp_to changes the state of a request that is already terminal
 *   NO_P2, NO_P3               leave those assertions out, to see what the bug leads to next
 *   WITNESS                    assert that the hazardous-but-safe path is unreachable; pan must
 *                              refute it, which shows the real model exercises that path
 *   WITNESS_DECODE_RELEASE     assert that no page is ever freed by end_ops, i.e. that no release
 *                              finds a decode-step write outstanding (refuted: the decoding +
 *                              outstanding write + concurrent Release race is reachable)
 *   WITNESS_DUPLICATE_DECODE   assert that no duplicate Decode arrives while the first one's
 *                              sequence is in the batch (refuted: the race is reachable)
 *   WITNESS_POST_AFTER_RELEASE assert that the transfer handler never finds, when it is about to
 *                              post a batch's receives, its reservation released and a page of
 *                              the batch reserved by the other request (refuted: the race the
 *                              post_batch check closes is reachable)
 *
 * Invariants; every assertion starts with a hidden, always-1 tag so pan's message names it
 *   P1_isolation   when request r's decode reads page p (its index i) the page is owned by r at
 *                  the generation in r's block table, and holds exactly the bytes r's prefill
 *                  wrote for index i, landed at that generation
 *   P2_no_free_while_write_outstanding
 *                  no page is freed or allocated while an operation that may write into it is
 *                  outstanding: a posted receive, or a decode step between begin_ops and
 *                  end_ops; a write (a landing receive or a decode step's KV write) lands only
 *                  in a page its reservation owns at the generation it was posted / claimed for
 *   P3_only_verified_enter_decode
 *                  a rejected or aborted request never enters the decode batch, and no
 *                  sequence enters it once its reservation has been released
 *   P4_pool_drained
 *                  when nothing can move any more (every request terminal, every message gone)
 *                  every page is FREE with no owner and no reservation holds pages: aborts,
 *                  lost Releases and timeouts never leak pages, and quarantine always ends
 *   P5_terminal_never_resumed
 *                  once a request's lifecycle state is terminal (reached through cp_to) every
 *                  later lifecycle change leaves it as it is
 * pan also reports invalid end states: a state where some process is stuck mid-protocol.
 */

#define NREQ 2
#define NPAGES 3
#define NEED 2                  /* most pages one reservation holds */
/* pages reserved for request r, ceil((prompt + max_new) / page_size): request 0 needs 2, request
 * 1 needs 1, so the two can hold pages at the same time and can also reuse each other's pages */
#define NEED_OF(r) ((r) == 0 -> 2 : 1)
#define PAGE_TOKENS 4
#define PROMPT_TOKENS(r) (NEED_OF(r) * PAGE_TOKENS)     /* the prompt fills the reservation */
#define PLACEHOLDER_TOKENS 1
#define NONE 255

#if NREQ != 2 || NEED != 2 || NPAGES != 3
#error "the unrolled alternatives below assume NREQ == 2, NEED == 2, NPAGES == 3"
#endif

#if defined(MUTANT_PLACEHOLDER) || defined(MUTANT_PLACEHOLDER_CP_ONLY)
#define BUG_REJECTED_GOES_TO_PREFILL
#endif
#if defined(MUTANT_PLACEHOLDER) || defined(MUTANT_NO_COUNT_CHECK)
#define BUG_NO_COUNT_CHECK
#endif

#ifdef MUTANT_LEAK_QUARANTINE
#define QUARANTINE_RELEASED 0
#else
#define QUARANTINE_RELEASED 1
#endif

#ifdef NO_P2
#define assert_p2(e) skip
#else
#define assert_p2(e) assert(P2_no_free_while_write_outstanding && (e))
#endif
#ifdef NO_P3
#define assert_p3(e) skip
#else
#define assert_p3(e) assert(P3_only_verified_enter_decode && (e))
#endif

hidden byte P1_isolation = 1;
hidden byte P2_no_free_while_write_outstanding = 1;
hidden byte P3_only_verified_enter_decode = 1;
hidden byte P4_pool_drained = 1;
hidden byte P5_terminal_never_resumed = 1;
hidden byte WITNESS_late_write_page_reused = 1;
hidden byte WITNESS_release_during_decode_write = 1;
hidden byte WITNESS_duplicate_decode_while_decoding = 1;
hidden byte WITNESS_post_after_release_and_reserve = 1;
hidden byte j;                  /* loop index inside d_steps (no value survives a step) */

/* control plane request lifecycle; states >= CP_FINISHED are terminal */
#define CP_RECEIVED 0
#define CP_ADMITTED 1
#define CP_PREFILLING 2
#define CP_KV_VERIFIED 3
#define CP_DECODING 4
#define CP_FINISHED 5
#define CP_REJECTED 6
#define CP_FAILED 7
#define CP_CANCELLED 8
#define cp_terminal(r) (cp_state[r] >= CP_FINISHED)

#define PG_FREE 0
#define PG_RECEIVING 1
#define PG_READY 2
#define PG_IN_USE 3
#define PG_QUARANTINED 4                /* failed/aborted, or released with an operation open */

/* reservation on decode; its id is the request id and is never reused */
#define RS_NONE 0
#define RS_RECEIVING 1
#define RS_VERIFYING 2          /* manifest accepted, waiting for the listed receives */
#define RS_DECODING 3           /* KV verified; its Decode stream is open (service DECODING) */
#define RS_QUARANTINED 4        /* failed or aborted: pages held until no receive can land */
#define RS_GONE 5               /* released (pages with a decode write open stay QUARANTINED) */

/* the Decode stream of a verified reservation */
#define SM_NONE 0               /* no stream, or one whose remaining steps change nothing */
#define SM_VERIFIED 1           /* yielded `verified`; re-check and batcher.add still to come */
#define SM_OPEN 2               /* its sequence was added; waiting for events */
#define SM_FINISH 3             /* the batcher posted finish; the stream has not read it yet */
#define SM_ERROR 4              /* the batcher posted an error (tag check, page not owned) */

/* the decode step a sequence is in; it writes into its last page, index NEED_OF(r) - 1 */
#define WR_IDLE 0
#define WR_CLAIMED 1            /* begin_ops done, the kernel has not written yet */
#define WR_WRITTEN_OK 2         /* written and attended, every tag matched; end_ops to come */
#define WR_WRITTEN_BAD 3        /* written; a page's tag did not match (integrity error) */
#define DK(r) ((r) * NEED + NEED_OF(r) - 1)

/* posted UCX tagged receive for (reservation, page index) */
#define RX_NONE 0
#define RX_POSTED 1
#define RX_CANCELLING 2         /* cancel requested; the data may still land */
#define RX_DONE 3               /* completed (data landed) or cancelled */
#define rx_outstanding(k) (rx[k] == RX_POSTED || rx[k] == RX_CANCELLING)

/* the bytes prefill writes for (request r, page index i); 0 = never written since boot */
#define DATA(r, i) ((r) * NEED + (i) + 1)

byte cp_state[NREQ];
byte cp_final[NREQ];            /* ghost: the terminal state cp_to first set (0: none yet); in the
                                 * real model a function of cp_state, so it adds no state */
bit rejected[NREQ];             /* ghost: admission found the request over-length */
bit aborted[NREQ];              /* ghost: decode failed or aborted the reservation */

byte pg_state[NPAGES];
byte pg_owner[NPAGES] = NONE;
byte pg_gen[NPAGES];            /* bumped on allocation and on free */
byte pg_data[NPAGES];           /* whose bytes the page holds: DATA(r, i), or 0 */
byte pg_wgen[NPAGES];           /* pg_gen[p] when those bytes landed */
byte pg_ops[NPAGES];            /* decode-step writes outstanding (pool begin_ops/end_ops) */
bit pg_rel[NPAGES];             /* released while an operation was outstanding: end_ops frees */
byte nfree = NPAGES;

byte rs_state[NREQ];
byte rs_page[NREQ * NEED];      /* block table: page id of index i ... */
byte rs_gen[NREQ * NEED];       /* ... and its generation at allocation */
byte rs_listed[NREQ];           /* pages covered by the accepted manifest */
byte rx[NREQ * NEED];           /* receive k = r * NEED + i lands in rs_page[k] */
byte tx_batch[NREQ];            /* hello verified and a batch header of this many pages read:
                                 * its receives are not posted yet (0: no batch pending) */

bit pf_start[NREQ];             /* the control plane handed the reservation to prefill */
byte pf_tokens[NREQ];           /* prompt tokens prefill is told to run */
byte mf_tokens[NREQ];           /* the manifest prefill sent: token_count, ... */
byte mf_npages[NREQ];           /* ... number of page entries, ... */
byte mf_page[NREQ * NEED];      /* ... and the (page_id, generation) entries */
byte mf_gen[NREQ * NEED];

bit net_data[NREQ * NEED];      /* page message (reservation id, page index) in flight */
bit net_mf[NREQ];               /* a Decode call (with the manifest) in flight */

byte sm[NREQ];                  /* Decode stream: SM_* */
bit bt[NREQ];                   /* its sequence is in the batcher's active set */
byte wr[NREQ];                  /* its decode step: WR_* */

#ifdef WITNESS
bit late[NPAGES];               /* ghost: a write landed here after its receive was cancelled */
#endif

/* ----------------------------------------------------------------------- helpers */

/* P2: no receive of any reservation and no decode step can still write into page p */
#define no_write_into(p) \
    (!((rx_outstanding(0) && rs_page[0] == (p)) || (rx_outstanding(1) && rs_page[1] == (p)) || \
       (rx_outstanding(2) && rs_page[2] == (p)) || (rx_outstanding(3) && rs_page[3] == (p))) && \
     pg_ops[p] == 0)

/* every lifecycle change after admission goes through here; a terminal request is never
 * resumed (control_plane/lifecycle.py: `allowed` has no way out of a terminal state). P5 checks
 * it: the first terminal state cp_to sets is the last. Always called inside an atomic step. */
inline cp_to(r, s) {
#ifdef MUTANT_CP_RESUMES_TERMINAL
    cp_state[r] = s;                    /* bug: no guard, a terminal request moves on */
#else
    if
    :: cp_terminal(r) -> skip
    :: else -> cp_state[r] = s
    fi;
#endif
    assert(P5_terminal_never_resumed && (cp_final[r] == 0 || cp_state[r] == cp_final[r]));
    if
    :: cp_final[r] == 0 && cp_terminal(r) -> cp_final[r] = cp_state[r]
    :: else
    fi
}

/* A receive stops being outstanding: the copies of its page message still in flight can never
 * match anything again (tags are never reused), so the network forgets them. This only merges
 * states no observer can tell apart; it is also why duplicating page messages adds nothing. */
inline rx_finish(k) {
    rx[k] = RX_DONE;
    net_data[k] = 0
}

/* The reservation leaves RECEIVING for good: what a manifest that arrives later says no longer
 * matters (it fails check 1 whatever it holds), so prefill's manifest buffer forgets it. A copy
 * of the Decode call still in flight is kept until the reservation is released: arriving while
 * the reservation is held, it is a duplicate Decode and fails the request. */
inline leave_receiving(r) {
    mf_tokens[r] = 0;
    mf_npages[r] = 0;
    mf_page[r * NEED] = 0;
    mf_gen[r * NEED] = 0;
    mf_page[r * NEED + 1] = 0;
    mf_gen[r * NEED + 1] = 0
}

/* ----------------------------------------------------------------------- decode */

/* Reserve RPC. Any free page may be picked (the allocator policy is not part of the proof);
 * allocation bumps the generation. No receive is posted yet: decode posts a batch's receives
 * only after the transfer's hello is verified and its batch header read (post_batch). */
inline decode_reserve(r, i, p) {
    i = 0;
    do
    :: i < NEED_OF(r) ->
        if
        :: pg_state[0] == PG_FREE -> p = 0
        :: pg_state[1] == PG_FREE -> p = 1
        :: pg_state[2] == PG_FREE -> p = 2
        fi;
        assert_p2(no_write_into(p));
        pg_state[p] = PG_RECEIVING;
        pg_owner[p] = r;
        pg_gen[p]++;
        nfree--;
        rs_page[r * NEED + i] = p;
        rs_gen[r * NEED + i] = pg_gen[p];
        i++
    :: else -> break
    od;
    rs_state[r] = RS_RECEIVING;
    i = 0;
    p = 0
}

inline free_page(p) {
    assert_p2(no_write_into(p));
    pg_state[p] = PG_FREE;
    pg_owner[p] = NONE;
    pg_gen[p]++;
    nfree++
}

/* pool.release of one page: free it, or, with an operation outstanding, leave it QUARANTINED
 * and let the end_ops that settles the last operation free it */
inline put_page(p) {
#ifdef MUTANT_RELEASE_IGNORES_OPS
    free_page(p)                        /* bug: a decode step may still write into it */
#else
    if
    :: pg_ops[p] > 0 ->
        pg_rel[p] = 1;
        pg_state[p] = PG_QUARANTINED
    :: else -> free_page(p)
    fi
#endif
}

/* The block table and receive slots of a released reservation are forgotten once nothing
 * refers to them any more: no receive outstanding (mutants only), no batch waiting to be
 * posted (the transfer handler still holds the page refs) and no decode step open. */
inline forget_table(r) {
    if
    :: rs_state[r] == RS_GONE && !rx_outstanding(r * NEED) && !rx_outstanding(r * NEED + 1) &&
       tx_batch[r] == 0 && wr[r] == WR_IDLE ->
        rx[r * NEED] = RX_NONE;
        rx[r * NEED + 1] = RX_NONE;
        rs_page[r * NEED] = 0;
        rs_page[r * NEED + 1] = 0;
        rs_gen[r * NEED] = 0;
        rs_gen[r * NEED + 1] = 0
    :: else
    fi
}

/* release; the real decode calls this only once no receive of r is outstanding */
inline release(r) {
    for (j : 0 .. NEED_OF(r) - 1) {
        put_page(rs_page[r * NEED + j])
    };
    j = 0;
    rs_state[r] = RS_GONE;
    rs_listed[r] = 0;
    forget_table(r)
}

/* _release: leave the batch, end the open stream, then pool.release now if no receive can land
 * any more, else hold the pages in quarantine. From here on the reservation is unknown to
 * decode: a Decode call still in flight will be dropped, so the network forgets it. */
inline release_when_quiet(r) {
    bt[r] = 0;                          /* batcher.remove, under the batcher lock */
    if
    :: sm[r] >= SM_OPEN -> sm[r] = SM_NONE   /* its stream ends CANCELLED; finally: no-op */
    :: else                             /* SM_VERIFIED: the stream still has to re-check */
    fi;
    net_mf[r] = 0;
    if
    :: !rx_outstanding(r * NEED) && !rx_outstanding(r * NEED + 1) -> release(r)
    :: else -> rs_state[r] = RS_QUARANTINED
    fi
}

/* receiver.cancel: every posted receive of r is asked to cancel (its data may still land) */
inline cancel_receives(r) {
    for (j : 0 .. NEED_OF(r) - 1) {
        if
        :: rx[r * NEED + j] == RX_POSTED -> rx[r * NEED + j] = RX_CANCELLING
        :: else
        fi
    };
    j = 0
}

/* failure, abort or Release: cancel every posted receive; pages stay quarantined until all are
 * done (and, page by page, until no decode step writes into them) */
inline quarantine(r) {
    aborted[r] = 1;
    for (j : 0 .. NEED_OF(r) - 1) {
        pg_state[rs_page[r * NEED + j]] = PG_QUARANTINED
    };
    j = 0;
    cancel_receives(r);
    cp_to(r, CP_FAILED);
    release_when_quiet(r)
}

/* manifest checks 1, 3 and 4 (MAC, model fingerprint and layout are abstracted away) */
#define entry_ok(r, i) \
    (mf_page[(r) * NEED + (i)] == rs_page[(r) * NEED + (i)] && \
     mf_gen[(r) * NEED + (i)] == pg_gen[rs_page[(r) * NEED + (i)]])

#ifdef BUG_NO_COUNT_CHECK
#define count_and_coverage_ok(r) 1
#else
#define count_and_coverage_ok(r) \
    (mf_tokens[r] == PROMPT_TOKENS(r) && mf_npages[r] == NEED_OF(r) && \
     mf_npages[r] == (mf_tokens[r] + PAGE_TOKENS - 1) / PAGE_TOKENS)
#endif

/* A Decode call arrives with its manifest. */
inline on_manifest(r) {
    if
    :: rs_state[r] == RS_VERIFYING || rs_state[r] == RS_DECODING ->
        /* a duplicate Decode: check 1 (reservation RECEIVING) fails; _integrity_failure
         * quarantines and _release releases the reservation, ending the first stream */
#ifdef WITNESS_DUPLICATE_DECODE
        assert(WITNESS_duplicate_decode_while_decoding && !bt[r]);
#endif
        quarantine(r)
    :: rs_state[r] != RS_RECEIVING -> skip   /* unknown or released: nothing to act on */
    :: else ->
        if
        :: mf_npages[r] >= 1 && entry_ok(r, 0) && (mf_npages[r] < 2 || entry_ok(r, 1)) &&
           count_and_coverage_ok(r) ->
            rs_state[r] = RS_VERIFYING;
            rs_listed[r] = mf_npages[r];
            leave_receiving(r)
        :: else ->
            leave_receiving(r);
            quarantine(r)                /* DATA_LOSS */
        fi
    fi
}

/* pool.owns(rid, refs) for the receive of index i */
#define owns_rx(r, i) \
    (pg_owner[rs_page[(r) * NEED + (i)]] == (r) && \
     pg_gen[rs_page[(r) * NEED + (i)]] == rs_gen[(r) * NEED + (i)] && \
     !pg_rel[rs_page[(r) * NEED + (i)]])

/* _receive_pages: the handler resumes after the awaits of the hello's answer and the batch
 * header, which a Release (cancel, pool.release, forget) and a Reserve of the same pages by
 * another request may have come between. With no await between check and post, it posts the
 * batch's receives only if the transfer is still RECEIVING (the model's reservation receiving
 * or verifying: not cancelled) and the pool still gives every page of the batch to it at the
 * generation the handler holds; else RESERVATION_RELEASED and nothing is posted. The pages of a
 * batch whose receives will never be posted are dead (tags are never reused): forgotten. */
inline post_batch(r) {
#ifdef MUTANT_POST_AFTER_RELEASE
    /* bug: no check, and the Release's endpoint abort did nothing; only pool.begin_ops, which
     * raises on a free page, still refuses a batch (a page reserved again passes it) */
    if
    :: pg_owner[rs_page[r * NEED]] != NONE &&
       (tx_batch[r] < 2 || pg_owner[rs_page[r * NEED + 1]] != NONE) ->
#else
    if
    :: (rs_state[r] == RS_RECEIVING || rs_state[r] == RS_VERIFYING) &&
       owns_rx(r, 0) && (tx_batch[r] < 2 || owns_rx(r, 1)) ->
#endif
        rx[r * NEED] = RX_POSTED;
        if
        :: tx_batch[r] > 1 -> rx[r * NEED + 1] = RX_POSTED
        :: else
        fi;
        tx_batch[r] = 0
    :: else ->
#ifdef WITNESS_POST_AFTER_RELEASE
        assert(WITNESS_post_after_release_and_reserve &&
               !(pg_owner[rs_page[r * NEED]] != NONE && pg_owner[rs_page[r * NEED]] != r));
#endif
        tx_batch[r] = 0;
        net_data[r * NEED] = 0;
        net_data[r * NEED + 1] = 0;
        forget_table(r)
    fi
}

#define listed_done(r) \
    (rx[(r) * NEED] == RX_DONE && (rs_listed[r] < 2 || rx[(r) * NEED + 1] == RX_DONE))

/* check 5: the checksum, seeded with reservation id and page index, over the received bytes */
#define page_ok(r, i) \
    (pg_data[rs_page[(r) * NEED + (i)]] == DATA(r, i) && \
     pg_wgen[rs_page[(r) * NEED + (i)]] == pg_gen[rs_page[(r) * NEED + (i)]])

inline on_data_complete(r) {
    if
    :: page_ok(r, 0) && (rs_listed[r] < 2 || page_ok(r, 1)) ->
        rs_state[r] = RS_DECODING;      /* res.state = DECODING, pages READY -> IN_USE */
        for (j : 0 .. NEED_OF(r) - 1) {
            pg_state[rs_page[r * NEED + j]] = PG_IN_USE
        };
        j = 0;
        sm[r] = SM_VERIFIED;            /* the stream yields `verified` and is suspended */
        cp_to(r, CP_KV_VERIFIED)
    :: else -> quarantine(r)
    fi
}

/* The paged-attention kernel compares page_gen with the block table (a mismatch is an
 * integrity error, not a read); P1 asks for more: the bytes are r's own, for this index and
 * this generation, and r owns the page. */
inline read_page(r, i) {
    if
    :: pg_gen[rs_page[r * NEED + i]] != rs_gen[r * NEED + i] -> ok = 0
    :: else ->
        assert(P1_isolation && pg_owner[rs_page[r * NEED + i]] == r &&
               pg_data[rs_page[r * NEED + i]] == DATA(r, i) &&
               pg_wgen[rs_page[r * NEED + i]] == rs_gen[r * NEED + i]);
#ifdef WITNESS
        assert(WITNESS_late_write_page_reused && !late[rs_page[r * NEED + i]]);
#endif
        skip
    fi
}

/* ---- the Decode stream (event loop) */

/* Resumed after the `verified` message: a Release (or a duplicate Decode) may have released the
 * reservation meanwhile; never add a sequence whose reservation is gone. */
inline stream_start(r) {
#ifdef MUTANT_ADD_AFTER_RELEASE
    if
    :: true ->
#else
    if
    :: rs_state[r] == RS_DECODING ->
#endif
        assert_p3(!rejected[r] && !aborted[r] && rs_state[r] == RS_DECODING);
        bt[r] = 1;                      /* batcher.add */
        sm[r] = SM_OPEN;
        cp_to(r, CP_DECODING)
    :: else -> sm[r] = SM_NONE          /* abort(Cancelled); finally: the release is a no-op */
    fi
}

/* The stream reads the event the batcher posted and ends; its `finally` releases. */
inline stream_end(r) {
    if
    :: sm[r] == SM_FINISH -> cp_to(r, CP_FINISHED)
    :: else -> aborted[r] = 1;
        cp_to(r, CP_FAILED)
    fi;
    if
    :: rs_state[r] == RS_DECODING && sm[r] == SM_FINISH -> sm[r] = SM_NONE;
        cancel_receives(r);             /* none is posted, unless the count check is gone */
        release_when_quiet(r)
    :: rs_state[r] == RS_DECODING -> sm[r] = SM_NONE;
        quarantine(r)                   /* integrity error: quarantine, then release */
    :: else -> sm[r] = SM_NONE          /* already released (a mutant only gets here) */
    fi
}

/* ---- the decode engine (batcher thread) */

/* pool.owns(seq, [page]): held by r at the block table's generation and not released */
#define owns_dpage(r) \
    (pg_owner[rs_page[DK(r)]] == (r) && pg_gen[rs_page[DK(r)]] == rs_gen[DK(r)] && \
     !pg_rel[rs_page[DK(r)]])

/* _claim, under the batcher lock (which remove() takes): the page the step writes into is
 * counted as an operation; a sequence whose page is no longer its own leaves with an error */
inline claim(r) {
    if
    :: owns_dpage(r) ->
        pg_ops[rs_page[DK(r)]]++;       /* begin_ops */
        wr[r] = WR_CLAIMED
    :: else -> bt[r] = 0;
        sm[r] = SM_ERROR
    fi
}

/* The kernel: writes this token's KV into the page claimed (P2: a page r still owns at the
 * generation it was claimed at), then attends over every page of the block table (P1). It
 * may run after a Release has taken the sequence out: the claimed page is still r's. The
 * write goes into the new token's slot: in r's own page it leaves the prompt KV (what pg_data
 * tracks) as it is; in a page r no longer holds (a mutant) it overwrites whatever is there. */
inline write_and_attend(r) {
    assert_p2(pg_owner[rs_page[DK(r)]] == r && pg_gen[rs_page[DK(r)]] == rs_gen[DK(r)] &&
              pg_ops[rs_page[DK(r)]] > 0);
    if
    :: pg_owner[rs_page[DK(r)]] == r && pg_gen[rs_page[DK(r)]] == rs_gen[DK(r)]
    :: else -> pg_data[rs_page[DK(r)]] = DATA(r, NEED_OF(r) - 1)
    fi;
    ok = 1;
    for (j : 0 .. NEED_OF(r) - 1) {
        read_page(r, j)
    };
    j = 0;
    if
    :: ok -> wr[r] = WR_WRITTEN_OK
    :: else -> wr[r] = WR_WRITTEN_BAD
    fi;
    ok = 0
}

/* end_ops; a page released while the step ran is freed by the end_ops that settles it */
inline end_ops(p) {
    pg_ops[p]--;
    if
    :: pg_ops[p] == 0 && pg_rel[p] ->
#ifdef WITNESS_DECODE_RELEASE
        /* reached only if a release came while this decode step's write was outstanding */
        assert(WITNESS_release_during_decode_write && 0);
#endif
        pg_rel[p] = 0;
        free_page(p)
    :: else
    fi
}

/* After the step: end_ops, then (if the sequence is still in the batch) an integrity error
 * ends it, or it finishes (EOS, stop, length), or it goes on to the next step. */
inline end_step(r, finish) {
    end_ops(rs_page[DK(r)]);
    if
    :: bt[r] && wr[r] == WR_WRITTEN_BAD -> bt[r] = 0;
        sm[r] = SM_ERROR
    :: bt[r] && finish -> bt[r] = 0;
        sm[r] = SM_FINISH
    :: else
    fi;
    wr[r] = WR_IDLE;
    forget_table(r)
}

inline on_timeout(r) {
    if
    :: rs_state[r] == RS_RECEIVING -> leave_receiving(r)
    :: else
    fi;
    quarantine(r);
#ifdef MUTANT_RELEASE_ON_TIMEOUT
    if
    :: rs_state[r] == RS_QUARANTINED -> release(r)    /* bug: a cancelled receive may land */
    :: else
    fi
#else
    skip
#endif
}

/* Release RPC (client cancel, deadline, operator abort) or the control plane cancelling the
 * Decode stream (its finally releases): both are _release, at any point of the reservation */
inline on_abort(r) {
    if
    :: rs_state[r] == RS_RECEIVING -> leave_receiving(r);
        quarantine(r)
    :: rs_state[r] == RS_VERIFYING || rs_state[r] == RS_DECODING -> quarantine(r)
    :: else
    fi
}

/* decode's own timeouts: the per-batch timeout and the reaper (a reservation never verified,
 * transfer.reservation_timeout_s after Reserve); what gives the pages back when the control
 * plane's Release is lost */
#ifdef MUTANT_NO_DECODE_TIMEOUT
#define DECODE_TIMEOUT(r)
#else
#define DECODE_TIMEOUT(r) \
    :: d_step { (rs_state[r] == RS_RECEIVING || rs_state[r] == RS_VERIFYING) -> on_timeout(r) }
#endif

#define DECODE_EVENTS(r) \
    :: d_step { tx_batch[r] > 0 -> post_batch(r) } \
    :: d_step { rs_state[r] == RS_VERIFYING && listed_done(r) -> on_data_complete(r) } \
    :: d_step { sm[r] == SM_VERIFIED -> stream_start(r) } \
    :: d_step { sm[r] >= SM_FINISH -> stream_end(r) } \
    DECODE_TIMEOUT(r) \
    :: d_step { QUARANTINE_RELEASED && rs_state[r] == RS_QUARANTINED && \
                !rx_outstanding((r) * NEED) && !rx_outstanding((r) * NEED + 1) -> release(r) }

active proctype Decode() {
end_decode:
    do
    DECODE_EVENTS(0)
    DECODE_EVENTS(1)
    od
}

/* One step of sequence r: claim, write and attend, end (and go on, or finish). Steps of the two
 * sequences interleave freely (a superset of the real batched steps). */
#define BATCHER_STEPS(r) \
    :: d_step { bt[r] && wr[r] == WR_IDLE -> claim(r) } \
    :: d_step { wr[r] == WR_CLAIMED -> write_and_attend(r) } \
    :: d_step { wr[r] >= WR_WRITTEN_OK -> end_step(r, 0) } \
    :: d_step { wr[r] == WR_WRITTEN_OK && bt[r] -> end_step(r, 1) }

active proctype Batcher() {
    bit ok;
end_batcher:
    do
    BATCHER_STEPS(0)
    BATCHER_STEPS(1)
    od
}

/* ----------------------------------------------------------------------- control plane */

proctype ControlPlane(byte r) {
    byte i, p;
    /* admission, before any node is contacted */
    if
    :: cp_state[r] = CP_REJECTED;       /* prompt + max_new over the admissible limit */
        rejected[r] = 1;
#ifdef BUG_REJECTED_GOES_TO_PREFILL
        /* the rejection sits in a field the disaggregation queue does not look at */
        cp_state[r] = CP_ADMITTED;
        pf_tokens[r] = PLACEHOLDER_TOKENS
#else
        goto done
#endif
    :: cp_state[r] = CP_ADMITTED;
        pf_tokens[r] = PROMPT_TOKENS(r)
    fi;
    /* wait in the bounded queue for capacity, or give up at the deadline */
    if
    :: atomic {
        nfree >= NEED ->
        decode_reserve(r, i, p);
        pf_start[r] = 1;                /* hand the reservation (pages, generations) over */
        cp_to(r, CP_PREFILLING)
    }
    :: d_step { cp_to(r, CP_FAILED) };  /* RESOURCE_EXHAUSTED; nothing was reserved */
        goto done
    fi;
    /* decode reports KV_VERIFIED, DECODING, FINISHED or FAILED; or the client cancels, at any
     * point, decoding included. Decode gets the Release (or the Decode stream's cancel), or the
     * Release is lost (control_plane/routing.py logs and swallows a failed Release): then decode
     * never hears of it and carries on with what it holds, so only its own timeout (the reaper)
     * or the stream's end gives the pages back. The control plane makes no Decode call for the
     * request any more: one still in flight is cancelled before it reaches decode, and prefill
     * sends none for a terminal request (prefill_run). */
    if
    :: cp_terminal(r)
    :: d_step { !cp_terminal(r) -> cp_to(r, CP_CANCELLED); on_abort(r) }
    :: d_step { !cp_terminal(r) -> cp_to(r, CP_CANCELLED);    /* its Release lost */
                net_mf[r] = 0 }
    fi;
done:
    skip
}

/* ----------------------------------------------------------------------- prefill */

/* Runs the prompt and sends its hello, which decode verifies (the reservation is known and its
 * transfer EXPECTING: now RECEIVING), the batch header (the indices of the pages it sends),
 * one message per written page and then the manifest. One step suffices: the network may hold
 * any message back arbitrarily long, and a page message waits in UCX, unmatched, until decode
 * posts its receive (post_batch, a later step). A sender bug may truncate the page list (as
 * Mooncake does on a count mismatch) while still claiming the full token count. For a
 * reservation no longer RECEIVING decode refuses the hello (RESERVATION_RELEASED): nothing of
 * it could ever be received, so nothing is put in flight. The manifest goes to the control
 * plane, which makes the Decode call with it (net_mf): not for a request it has ended. */
inline prefill_run(r, n) {
    pf_start[r] = 0;
    n = (pf_tokens[r] + PAGE_TOKENS - 1) / PAGE_TOKENS;
    if
    :: skip
    :: n > 1 -> n = 1                   /* sender fault: truncated page list */
    fi;
    if
    :: rs_state[r] == RS_RECEIVING ->
        tx_batch[r] = n;                /* the handler reads the header of a batch of n pages */
        for (j : 0 .. n - 1) {
            net_data[r * NEED + j] = 1
        };
        j = 0;
        mf_tokens[r] = pf_tokens[r];
        mf_npages[r] = n;
        mf_page[r * NEED] = rs_page[r * NEED];    /* the descriptor handed over at reserve */
        mf_gen[r * NEED] = rs_gen[r * NEED];
        if
        :: n > 1 ->
            mf_page[r * NEED + 1] = rs_page[r * NEED + 1];
            mf_gen[r * NEED + 1] = rs_gen[r * NEED + 1]
        :: else
        fi;
        net_mf[r] = !cp_terminal(r)     /* none for a request the control plane ended */
    :: else
    fi;
    pf_tokens[r] = 0;
    n = 0
}

active proctype Prefill() {
    byte n;
end_prefill:
    do
    :: atomic { pf_start[0] -> prefill_run(0, n) }
    :: atomic { pf_start[1] -> prefill_run(1, n) }
    od
}

/* ----------------------------------------------------------------------- network / UCX */

/* A page message meets its posted receive and lands in that receive's page (a message sent
 * before its receive was posted waits for it). */
inline deliver_data(k) {
    assert_p2(pg_owner[rs_page[k]] == k / NEED && pg_gen[rs_page[k]] == rs_gen[k]);
#ifdef WITNESS
    if
    :: rx[k] == RX_CANCELLING -> late[rs_page[k]] = 1
    :: else
    fi;
#endif
    pg_data[rs_page[k]] = k + 1;        /* == DATA(k / NEED, k % NEED) */
    pg_wgen[rs_page[k]] = pg_gen[rs_page[k]];
    rx_finish(k)
}

#define NET_DATA(k) \
    :: d_step { net_data[k] && rx_outstanding(k) -> deliver_data(k) } \
    :: d_step { net_data[k] -> net_data[k] = 0 } \
    :: d_step { rx[k] == RX_CANCELLING -> rx_finish(k) }

/* the Decode call: delivered, delivered with a duplicate left in flight (a retried call, which
 * may arrive at any later point: while verifying, before the sequence joins the batch, while it
 * decodes), or lost */
#define NET_MF(r) \
    :: d_step { net_mf[r] -> net_mf[r] = 0; on_manifest(r) } \
    :: d_step { net_mf[r] -> on_manifest(r) } \
    :: d_step { net_mf[r] -> net_mf[r] = 0 }

active proctype Network() {
end_network:
    do
    NET_DATA(0)
    NET_DATA(1)
    NET_DATA(2)
    NET_DATA(3)
    NET_MF(0)
    NET_MF(1)
    od
}

/* Promela's timeout holds only when no other statement in the system is executable */
active proctype Auditor() {
    timeout;
    assert(P4_pool_drained && nfree == NPAGES &&
           pg_state[0] == PG_FREE && pg_state[1] == PG_FREE && pg_state[2] == PG_FREE &&
           pg_owner[0] == NONE && pg_owner[1] == NONE && pg_owner[2] == NONE &&
           (rs_state[0] == RS_NONE || rs_state[0] == RS_GONE) &&
           (rs_state[1] == RS_NONE || rs_state[1] == RS_GONE) &&
           pg_ops[0] == 0 && pg_ops[1] == 0 && pg_ops[2] == 0 &&
           cp_terminal(0) && cp_terminal(1))
}

init {
    atomic {
        run ControlPlane(0);
        run ControlPlane(1)
    }
}
