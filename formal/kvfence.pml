/*
 * kvfence: reserve / transfer / verify / decode / abort / release (DESIGN.md), in Promela.
 *
 * Processes
 *   ControlPlane(r)  one per request (request r belongs to tenant r): admission, Reserve RPC
 *                    to decode, hand-off to prefill, client cancel (Abort RPC to decode)
 *   Prefill          runs a handed-off request, sends one message per page, then a manifest
 *   Network          the data path: delivers any in-flight message (reordering), drops any
 *                    (loss), delivers a manifest twice (duplication); also UCX finishing a
 *                    requested cancel of a posted receive
 *   Decode           owns the page pool, the reservations and the posted receives: verifies,
 *                    times out, decodes, quarantines and releases
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
 *   NO_P2, NO_P3               leave those assertions out, to see what the bug leads to next
 *   WITNESS                    assert that the hazardous-but-safe path is unreachable; pan must
 *                              refute it, which shows the real model exercises that path
 *
 * Invariants; every assertion starts with a hidden, always-1 tag so pan's message names it
 *   P1_isolation   when request r's decode reads page p (its index i) the page is owned by r at
 *                  the generation in r's block table, and holds exactly the bytes r's prefill
 *                  wrote for index i, landed at that generation
 *   P2_no_free_while_write_outstanding
 *                  no page is freed or allocated while a posted receive into it (a write that
 *                  may still land) is outstanding; a write lands only in a page its reservation
 *                  owns at the generation the receive was posted for
 *   P3_only_verified_enter_decode
 *                  a rejected or aborted request never enters decode
 *   P4_pool_drained
 *                  when nothing can move any more (every request terminal, every message gone)
 *                  every page is FREE with no owner and no reservation holds pages: aborts and
 *                  timeouts never leak pages, and quarantine always ends
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
hidden byte WITNESS_late_write_page_reused = 1;
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
#define PG_QUARANTINED 4

/* reservation on decode; its id is the request id and is never reused */
#define RS_NONE 0
#define RS_RECEIVING 1
#define RS_VERIFYING 2          /* manifest accepted, waiting for the listed receives */
#define RS_READY 3              /* KV_VERIFIED */
#define RS_QUARANTINED 4        /* failed or aborted: pages held until no receive can land */
#define RS_GONE 5               /* pages released */

/* posted UCX tagged receive for (reservation, page index) */
#define RX_NONE 0
#define RX_POSTED 1
#define RX_CANCELLING 2         /* cancel requested; the data may still land */
#define RX_DONE 3               /* completed (data landed) or cancelled */
#define rx_outstanding(k) (rx[k] == RX_POSTED || rx[k] == RX_CANCELLING)

/* the bytes prefill writes for (request r, page index i); 0 = never written since boot */
#define DATA(r, i) ((r) * NEED + (i) + 1)

byte cp_state[NREQ];
bit rejected[NREQ];             /* ghost: admission found the request over-length */
bit aborted[NREQ];              /* ghost: decode failed or aborted the reservation */

byte pg_state[NPAGES];
byte pg_owner[NPAGES] = NONE;
byte pg_gen[NPAGES];            /* bumped on allocation and on free */
byte pg_data[NPAGES];           /* whose bytes the page holds: DATA(r, i), or 0 */
byte pg_wgen[NPAGES];           /* pg_gen[p] when those bytes landed */
byte nfree = NPAGES;

byte rs_state[NREQ];
byte rs_page[NREQ * NEED];      /* block table: page id of index i ... */
byte rs_gen[NREQ * NEED];       /* ... and its generation at allocation */
byte rs_listed[NREQ];           /* pages covered by the accepted manifest */
byte rx[NREQ * NEED];           /* receive k = r * NEED + i lands in rs_page[k] */

bit pf_start[NREQ];             /* the control plane handed the reservation to prefill */
byte pf_tokens[NREQ];           /* prompt tokens prefill is told to run */
byte mf_tokens[NREQ];           /* the manifest prefill sent: token_count, ... */
byte mf_npages[NREQ];           /* ... number of page entries, ... */
byte mf_page[NREQ * NEED];      /* ... and the (page_id, generation) entries */
byte mf_gen[NREQ * NEED];

bit net_data[NREQ * NEED];      /* page message (reservation id, page index) in flight */
bit net_mf[NREQ];               /* manifest in flight */

#ifdef WITNESS
bit late[NPAGES];               /* ghost: a write landed here after its receive was cancelled */
#endif

/* ----------------------------------------------------------------------- helpers */

/* P2: no receive of any reservation can still write into page p */
#define no_write_into(p) \
    !((rx_outstanding(0) && rs_page[0] == (p)) || (rx_outstanding(1) && rs_page[1] == (p)) || \
      (rx_outstanding(2) && rs_page[2] == (p)) || (rx_outstanding(3) && rs_page[3] == (p)))

/* every lifecycle change goes through here; a terminal request is never resumed */
inline cp_to(r, s) {
    if
    :: cp_terminal(r) -> skip
    :: else -> cp_state[r] = s
    fi
}

/* A receive stops being outstanding: the copies of its page message still in flight can never
 * match anything again (tags are never reused), so the network forgets them. This only merges
 * states no observer can tell apart; it is also why duplicating page messages adds nothing. */
inline rx_finish(k) {
    rx[k] = RX_DONE;
    net_data[k] = 0
}

/* The reservation leaves RECEIVING for good: any manifest still in flight will be dropped on
 * arrival (decode's first check), so the network and prefill's manifest buffer forget it. */
inline leave_receiving(r) {
    net_mf[r] = 0;
    mf_tokens[r] = 0;
    mf_npages[r] = 0;
    mf_page[r * NEED] = 0;
    mf_gen[r * NEED] = 0;
    mf_page[r * NEED + 1] = 0;
    mf_gen[r * NEED + 1] = 0
}

/* ----------------------------------------------------------------------- decode */

/* Reserve RPC. Any free page may be picked (the allocator policy is not part of the proof);
 * allocation bumps the generation; one tagged receive is posted per page. */
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
        rx[r * NEED + i] = RX_POSTED;
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

/* release; the real decode calls this only once no receive of r is outstanding */
inline release(r) {
    for (j : 0 .. NEED_OF(r) - 1) {
        free_page(rs_page[r * NEED + j])
    };
    j = 0;
    rs_state[r] = RS_GONE;
    rs_listed[r] = 0;
    if
    :: !rx_outstanding(r * NEED) && !rx_outstanding(r * NEED + 1) ->
        rx[r * NEED] = RX_NONE;
        rx[r * NEED + 1] = RX_NONE;
        rs_page[r * NEED] = 0;
        rs_page[r * NEED + 1] = 0;
        rs_gen[r * NEED] = 0;
        rs_gen[r * NEED + 1] = 0
    :: else                             /* mutant only: a receive still points at the page */
    fi
}

/* release now if nothing can land any more, else hold the pages in quarantine */
inline release_when_quiet(r) {
    if
    :: !rx_outstanding(r * NEED) && !rx_outstanding(r * NEED + 1) -> release(r)
    :: else -> rs_state[r] = RS_QUARANTINED
    fi
}

/* failure or abort: cancel every posted receive; pages stay quarantined until all are done */
inline quarantine(r) {
    aborted[r] = 1;
    for (j : 0 .. NEED_OF(r) - 1) {
        pg_state[rs_page[r * NEED + j]] = PG_QUARANTINED;
        if
        :: rx[r * NEED + j] == RX_POSTED -> rx[r * NEED + j] = RX_CANCELLING
        :: else
        fi
    };
    j = 0;
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

inline on_manifest(r) {
    if
    :: rs_state[r] != RS_RECEIVING -> skip   /* unknown, duplicate or late: dropped */
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

#define listed_done(r) \
    (rx[(r) * NEED] == RX_DONE && (rs_listed[r] < 2 || rx[(r) * NEED + 1] == RX_DONE))

/* check 5: the checksum, seeded with reservation id and page index, over the received bytes */
#define page_ok(r, i) \
    (pg_data[rs_page[(r) * NEED + (i)]] == DATA(r, i) && \
     pg_wgen[rs_page[(r) * NEED + (i)]] == pg_gen[rs_page[(r) * NEED + (i)]])

inline on_data_complete(r) {
    if
    :: page_ok(r, 0) && (rs_listed[r] < 2 || page_ok(r, 1)) ->
        rs_state[r] = RS_READY;
        for (j : 0 .. NEED_OF(r) - 1) {
            pg_state[rs_page[r * NEED + j]] = PG_READY
        };
        j = 0;
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

/* A verified reservation enters the batch; decode attends over every reserved page, the
 * request finishes and its pages are released. A client cancel while decoding ends in the
 * same release, so entering, decoding and finishing are one step. */
inline decode_run(r) {
    assert_p3(!rejected[r] && !aborted[r]);
    cp_to(r, CP_DECODING);
    ok = 1;
    for (j : 0 .. NEED_OF(r) - 1) {
        pg_state[rs_page[r * NEED + j]] = PG_IN_USE;
        read_page(r, j)
    };
    j = 0;
    if
    :: ok -> cp_to(r, CP_FINISHED)
    :: else -> aborted[r] = 1;
        cp_to(r, CP_FAILED)             /* integrity error */
    fi;
    ok = 0;
    release_when_quiet(r)
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

/* Abort RPC from the control plane (client cancel, deadline) */
inline on_abort(r) {
    if
    :: rs_state[r] == RS_RECEIVING -> leave_receiving(r);
        quarantine(r)
    :: rs_state[r] == RS_VERIFYING || rs_state[r] == RS_READY -> quarantine(r)
    :: else
    fi
}

#define DECODE_EVENTS(r) \
    :: d_step { rs_state[r] == RS_VERIFYING && listed_done(r) -> on_data_complete(r) } \
    :: d_step { rs_state[r] == RS_READY -> decode_run(r) } \
    :: d_step { (rs_state[r] == RS_RECEIVING || rs_state[r] == RS_VERIFYING) -> on_timeout(r) } \
    :: d_step { QUARANTINE_RELEASED && rs_state[r] == RS_QUARANTINED && \
                !rx_outstanding((r) * NEED) && !rx_outstanding((r) * NEED + 1) -> release(r) }

active proctype Decode() {
    bit ok;
end_decode:
    do
    DECODE_EVENTS(0)
    DECODE_EVENTS(1)
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
    :: cp_to(r, CP_FAILED);             /* RESOURCE_EXHAUSTED; nothing was reserved */
        goto done
    fi;
    /* decode reports KV_VERIFIED, DECODING, FINISHED or FAILED; or the client cancels */
    if
    :: cp_terminal(r)
    :: d_step { !cp_terminal(r) -> cp_to(r, CP_CANCELLED); on_abort(r) }
    fi;
done:
    skip
}

/* ----------------------------------------------------------------------- prefill */

/* Runs the prompt and puts one message per written page and then the manifest in flight. One
 * step suffices: the network may hold any message back arbitrarily long. A sender bug may
 * truncate the page list (as Mooncake does on a count mismatch) while still claiming the full
 * token count. Messages for a receive that is no longer outstanding, and a manifest for a
 * reservation no longer RECEIVING, could never be used and are not put in flight. */
inline prefill_run(r, n) {
    pf_start[r] = 0;
    n = (pf_tokens[r] + PAGE_TOKENS - 1) / PAGE_TOKENS;
    if
    :: skip
    :: n > 1 -> n = 1                   /* sender fault: truncated page list */
    fi;
    for (j : 0 .. n - 1) {
        if
        :: rx_outstanding(r * NEED + j) -> net_data[r * NEED + j] = 1
        :: else
        fi
    };
    j = 0;
    if
    :: rs_state[r] == RS_RECEIVING ->
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
        net_mf[r] = 1
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

/* A page message meets its posted receive and lands in that receive's page. */
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
    :: d_step { net_data[k] -> deliver_data(k) } \
    :: d_step { net_data[k] -> net_data[k] = 0 } \
    :: d_step { rx[k] == RX_CANCELLING -> rx_finish(k) }

/* delivered once, delivered twice (a duplicate), or lost */
#define NET_MF(r) \
    :: d_step { net_mf[r] -> net_mf[r] = 0; on_manifest(r) } \
    :: d_step { net_mf[r] -> net_mf[r] = 0; on_manifest(r); on_manifest(r) } \
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
           cp_terminal(0) && cp_terminal(1))
}

init {
    atomic {
        run ControlPlane(0);
        run ControlPlane(1)
    }
}
