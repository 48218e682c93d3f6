"""tools.sm90_compile.sass_loops: the loops of a kernel's SASS as cuobjdump prints it (the census
`--loops` prints per variant), on a hand-written listing: each backward branch closes a loop from
its target to itself, longest first; predicates and opcode suffixes are not opcodes."""
from __future__ import annotations

from tools.sm90_compile import sass_loops

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                  /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_CTAID.X ;                                    /* 0x0000000000007919 */
        /*0020*/              @P0  BRA 0x90 ;                                              /* 0x0000000000000947 */
        /*0030*/                   F2FP.F16.E4M3.UNPACK_B R4, R2 ;                         /* 0x000000020004723e */
        /*0040*/                   F2FP.F16.E4M3.UNPACK_B R5, R3 ;                         /* 0x000000030005723e */
        /*0050*/                   HMMA.16816.F32 R8, R4, R6, R8 ;                         /* 0x000000060408723c */
        /*0060*/               @!P1 IADD3 R2, R2, 0x80, RZ ;                              /* 0x0000008002029810 */
        /*0070*/                   ISETP.GE.AND P1, PT, R2, R7, PT ;                       /* 0x000000070200720c */
        /*0080*/              @!P1 BRA 0x30 ;                                              /* 0xfffffff000009947 */
        /*0090*/                   FADD R8, R8, R9 ;                                       /* 0x0000000908087221 */
        /*00a0*/                   BRA.U 0x90 ;                                            /* 0xfffffff000007947 */
        /*00b0*/                   EXIT ;                                                  /* 0x000000000000794d */
"""


def test_each_backward_branch_closes_a_loop_longest_first():
    loops = sass_loops(LISTING)
    assert [(loop.start, loop.end) for loop in loops] == [(0x30, 0x80), (0x90, 0xA0)]
    main = loops[0]
    assert main.length == 6 and dict(main.ops) == {"F2FP": 2, "HMMA": 1, "IADD3": 1, "ISETP": 1, "BRA": 1}
    assert main.summary(top=2) == "6 instructions: F2FP 2, HMMA 1"
    assert dict(loops[1].ops) == {"FADD": 1, "BRA": 1}


def test_a_listing_without_backward_branches_has_no_loops():
    assert sass_loops(LISTING.replace("@!P1 BRA 0x30", "@!P1 BRA 0x90").replace("BRA.U 0x90", "EXIT")) == []
