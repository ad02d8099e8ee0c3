"""Programs the language tests run (tests/pool/test_languages.py, and over
HTTP tests/serve/test_languages.py): one per language of the table, each
taking its case on stdin, with how each ends."""

import time

#: One program per language: the first word of stdin picks the case --
#: "exit" ends with 3, "crash" with the language's runtime error, "hang"
#: never ends, anything else is greeted in non-ASCII text.
PROGRAMS = {
    "c": r'''#include <stdio.h>
#include <string.h>
int main(void) {
    char w[64] = "";
    if (scanf("%63s", w) != 1) return 2;
    if (!strcmp(w, "exit")) return 3;
    if (!strcmp(w, "crash")) { volatile int *p = 0; *p = 1; }
    if (!strcmp(w, "hang")) return system(HANG);
    printf("héllo %s ✓\n", w);
    return 0;
}
''',
    "cpp": r'''#include <iostream>
#include <stdexcept>
#include <string>
int main() {
    std::string w;
    std::cin >> w;
    if (w == "exit") return 3;
    if (w == "crash") throw std::runtime_error("boom");
    if (w == "hang") return std::system(HANG);
    std::cout << "héllo " << w << " ✓" << std::endl;
}
''',
    "java": r'''import java.util.Scanner;
public class Main {
    public static void main(String[] args) throws Exception {
        String w = new Scanner(System.in).next();
        if (w.equals("exit")) System.exit(3);
        if (w.equals("crash")) throw new IllegalStateException("boom");
        if (w.equals("hang")) new ProcessBuilder("sh", "-c", HANG).inheritIO().start().waitFor();
        System.out.println("héllo " + w + " ✓");
    }
}
''',
    "rust": r'''use std::io::Read;
fn main() {
    let mut s = String::new();
    std::io::stdin().read_to_string(&mut s).unwrap();
    let w = s.split_whitespace().next().unwrap_or("");
    match w {
        "exit" => std::process::exit(3),
        "crash" => panic!("boom"),
        "hang" => { std::process::Command::new("sh").args(["-c", HANG]).status().unwrap(); }
        _ => println!("héllo {} ✓", w),
    }
}
''',
    "nodejs": r'''const w = require("fs").readFileSync(0, "utf8").trim().split(/\s+/)[0];
if (w === "exit") process.exit(3);
if (w === "crash") throw new Error("boom");
if (w === "hang") require("child_process").spawnSync("sh", ["-c", HANG], { stdio: "inherit" });
console.log(`héllo ${w} ✓`);
''',
    "perl": r'''my $w = <STDIN>; chomp $w;
exit 3 if $w eq "exit";
die "boom\n" if $w eq "crash";
system(HANG) if $w eq "hang";
print "héllo $w ✓\n";
''',
    "bash": r'''read -r w
case "$w" in
  exit) exit 3 ;;
  crash) echo boom >&2; kill -SEGV $$ ;;
  hang) sh -c HANG ;;
esac
echo "héllo $w ✓"
''',
    "python": r'''import sys
w = sys.stdin.read().split()[0]
if w == "exit": sys.exit(3)
if w == "crash": raise RuntimeError("boom")
if w == "hang": import subprocess; subprocess.run(HANG, shell=True)
print(f"héllo {w} ✓")
''',
}
PROGRAMS.update({
    "go": r'''package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
)

func main() {
	var w string
	fmt.Fscan(bufio.NewReader(os.Stdin), &w)
	switch w {
	case "exit":
		os.Exit(3)
	case "crash":
		panic("boom")
	case "hang":
		command := exec.Command("sh", "-c", HANG)
		command.Stdout = os.Stdout
		command.Run()
	}
	fmt.Printf("héllo %s ✓\n", w)
}
''',
    "typescript": r'''declare var require: any, process: any;
const w: string = require("fs").readFileSync(0, "utf8").trim().split(/\s+/)[0];
if (w === "exit") process.exit(3);
if (w === "crash") throw new Error("boom");
if (w === "hang") require("child_process").spawnSync("sh", ["-c", HANG], { stdio: "inherit" });
console.log(`héllo ${w} ✓`);
''',
    "php": r'''$w = trim(fgets(STDIN));
if ($w === "exit") exit(3);
if ($w === "crash") throw new Exception("boom");
if ($w === "hang") system(HANG);
echo "héllo $w ✓\n";
''',
    "lua": r'''local w = io.read("l")
if w == "exit" then os.exit(3) end
if w == "crash" then error("boom") end
if w == "hang" then os.execute(HANG) end
print("héllo " .. w .. " ✓")
''',
    "R": r'''w <- readLines(file("stdin"), n = 1)
if (w == "exit") quit(status = 3)
if (w == "crash") stop("boom")
if (w == "hang") system(HANG)
cat("héllo", w, "✓\n")
''',
    "ruby": r'''w = STDIN.read.split.first
exit 3 if w == "exit"
raise "boom" if w == "crash"
system(HANG) if w == "hang"
puts "héllo #{w} ✓"
''',
    "scala": r'''object Greeter {
  def main(args: Array[String]): Unit = {
    val w = scala.io.StdIn.readLine().trim
    if (w == "exit") sys.exit(3)
    if (w == "crash") throw new RuntimeException("boom")
    if (w == "hang") new java.lang.ProcessBuilder("sh", "-c", HANG).inheritIO().start().waitFor()
    println(s"héllo $w ✓")
  }
}
''',
    "racket": r'''#lang racket
(define w (string-trim (read-line)))
(when (equal? w "exit") (exit 3))
(when (equal? w "crash") (error "boom"))
(when (equal? w "hang") (system HANG))
(printf "héllo ~a ✓\n" w)
''',
    "csharp": r'''using System;
class Program {
    static int Main() {
        string w = Console.ReadLine().Trim();
        if (w == "exit") return 3;
        if (w == "crash") throw new InvalidOperationException("boom");
        if (w == "hang") {
            var shell = new System.Diagnostics.ProcessStartInfo("sh", "-c \"" + HANG + "\"");
            shell.UseShellExecute = false;
            System.Diagnostics.Process.Start(shell).WaitForExit();
        }
        Console.WriteLine($"héllo {w} ✓");
        return 0;
    }
}
''',
    "kotlin_script": r'''val w = readLine()!!.trim()
if (w == "exit") kotlin.system.exitProcess(3)
if (w == "crash") throw RuntimeException("boom")
if (w == "hang") ProcessBuilder("sh", "-c", HANG).inheritIO().start().waitFor()
println("héllo $w ✓")
''',
})
PROGRAMS["javascript"] = PROGRAMS["nodejs"]

#: What the "hang" case runs: a shell that ignores SIGTERM, says its pid
#: and never ends -- the program's process tree outlives a polite kill.
HANG = "trap '' TERM; echo $$; while :; do sleep 1; done"
#: Where a language interpolates "$" in double quotes, its literal is single-quoted.
_SINGLE_QUOTED = {"perl", "php", "bash"}
PROGRAMS = {language: program.replace("HANG", "'" + HANG.replace("''", '""') + "'" if language in _SINGLE_QUOTED
                                      else '"' + HANG + '"')
            for language, program in PROGRAMS.items()}

#: How each language's runtime error ends the program.
CRASH_EXIT = {"c": -11, "cpp": -6, "java": 1, "rust": 101, "nodejs": 1, "javascript": 1, "perl": 255, "bash": -11,
              "python": 1, "go": 2, "typescript": 1, "php": 255, "lua": 1, "R": 1, "ruby": 1, "scala": 1,
              "racket": 1, "kotlin_script": 3, "csharp": 1}

#: A compile error, for each language that compiles.
BROKEN = {"c": "int main(void) { return }\n", "cpp": "int main() { undeclared(); }\n",
          "java": "public class Main { void f( }\n", "rust": "fn main() { let x: i32 = \"no\"; }\n",
          "go": "package main\nfunc main() { undefined() }\n", "typescript": "const x = ;\n",
          "D_ut": "void main() { undefined(); }\n", "scala": "object Main { def main(a: Array[String]) = nope }\n",
          "verilog": "module tb; initial begin $display(; end endmodule\n",
          "junit": "public class MyTest { void f( }\n", "csharp": "class P { static void Main() { x = ; } }\n"}


#: Test runners: a passing and a failing test, and how each ends.
TEST_RUNNERS = {
    "go_test": ('package main\nimport "testing"\nfunc TestSum(t *testing.T) { if 1+1 != WANT { t.Fatal("sum") } }\n',
                "ok  ", "FAIL"),
    "junit": ("import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.assertEquals;\n"
              "public class SumTest { @Test void sums() { assertEquals(WANT, 1 + 1); } }\n",
              "1 tests successful", "1 tests failed"),
    "jest": ("import { describe, expect, test } from '@jest/globals';\n"
             "function add(a: number, b: number): number { return a + b; }\n"
             "describe('add', () => { test('adds', () => { expect(add(1, 1)).toBe(WANT); }); });\n",
             "Tests:       1 passed", "Tests:       1 failed"),
    "D_ut": ("unittest { assert(1 + 1 == WANT); }\nvoid main() {}\n", "1 modules passed unittests",
             "1/1 modules FAILED unittests"),
}


def slow_to_compile(n: int) -> str:
    """A C++ program whose compile evaluates n * n steps (n = 1000: about
    3 s here), unlike any other test's."""
    return ("constexpr long f(long n) { long s = 0; for (long i = 0; i < n; ++i) for (long j = 0; j < n; ++j) "
            f"s += (i ^ j) % 7; return s; }}\nstatic_assert(f({n}L) >= -{time.time_ns()});\nint main() {{}}\n")
