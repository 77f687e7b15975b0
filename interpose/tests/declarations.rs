//! A hook whose signature differs from its declaration must not compile;
//! one that matches must, and must reach the real function through `Real`.

#[test]
fn a_hook_compiles_only_with_the_declared_signature() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/declarations/matching.rs");
    cases.compile_fail("tests/declarations/mismatched_*.rs");
}
